#!/bin/bash
set -euo pipefail
sed 's/^port = 8080$/port = 9090/' /etc/webapp/app.ini > "$APP_HOME/app.ini"
