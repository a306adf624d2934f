#!/bin/bash
set -euo pipefail
grep -F ' [ERROR] ' /home/user/logs/app.log > /home/user/logs/errors.log
