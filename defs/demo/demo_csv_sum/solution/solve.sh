#!/bin/bash
set -euo pipefail
awk -F, 'NR > 1 { s += $3 } END { print s }' /home/user/data/sales.csv > /home/user/data/total.txt
