#!/bin/bash
set -euo pipefail
printf 'Hello, et-hpc!\n' > /home/user/greeting.txt
