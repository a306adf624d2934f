#!/bin/sh
# Compatibility layer that lets Ubuntu-22.04-style Endless Terminals defs build on the offline
# Debian base image (run inside the new root filesystem by `et-hpc base build --source debian`).
set -eu
# Ubuntu 22.04 allows system-wide `pip3 install`; Debian 12 refuses it (PEP 668) unless this goes.
rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
# Tasks put their fixtures under /home/user and the agent runs as the invoking (non-root) user.
mkdir -p /home/user && chmod 777 /home/user
# Keep apt usable in task builds and small in the image.
apt-get clean
rm -rf /var/lib/apt/lists/*
mkdir -p /var/lib/apt/lists/partial
# Some defs call `python` (Ubuntu images that install python-is-python3 have it).
[ -e /usr/bin/python ] || ln -s python3 /usr/bin/python
