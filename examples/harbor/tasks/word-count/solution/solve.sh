#!/bin/bash
set -euo pipefail
cd /srv/corpus
grep -oE '[A-Za-z]+' words.txt | tr 'A-Z' 'a-z' | sort -u | wc -l | tr -d ' ' > distinct.txt
