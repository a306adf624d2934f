#!/bin/bash
set -euo pipefail
cd /home/user
mkdir -p project/src project/docs
for f in inbox/*.py; do [ -e "$f" ] && mv -f "$f" project/src/; done
for f in inbox/*.md; do [ -e "$f" ] && mv -f "$f" project/docs/; done
(cd project && find src docs -type f | LC_ALL=C sort > MANIFEST.txt)
chmod u+x project/src/app.py
