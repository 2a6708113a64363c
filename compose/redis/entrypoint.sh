#!/bin/sh
# Starts redis-server with the password from the Docker secret in a config file, never on a
# command line (where `ps` and `docker inspect` would show it). Runs as root; the image's
# docker-entrypoint.sh drops to the redis user before starting the server.
set -eu
secret=${REDIS_PASSWORD_FILE:-/run/secrets/redis_password}
conf=${REDIS_CONF:-/usr/local/etc/verst-redis/redis.conf}
runtime=${REDIS_RUNTIME_DIR:-/run/verst-redis}
[ -s "$secret" ] || { echo "redis: the redis_password secret ($secret) is missing or empty" >&2; exit 2; }
password=$(cat "$secret")
case "$password" in
    *[!A-Za-z0-9._~-]*) echo "redis: the password may hold only A-Z a-z 0-9 . _ ~ - (openssl rand -hex 24)" >&2; exit 2 ;;
esac
: "${REDIS_MAXMEMORY:?set REDIS_MAXMEMORY, e.g. 2gb}"
mkdir -p "$runtime"
umask 077
{ cat "$conf"; printf 'maxmemory %s\nrequirepass "%s"\n' "$REDIS_MAXMEMORY" "$password"; } > "$runtime/redis.conf"
chown -R redis:redis "$runtime"
exec docker-entrypoint.sh redis-server "$runtime/redis.conf"
