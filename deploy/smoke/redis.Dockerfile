# Redis for deploy/compose-smoke where the official redis image cannot be pulled: Debian's
# redis-server on the locally built base (deploy/base-image), with a stand-in for the
# official image's docker-entrypoint.sh (docker-compose.yml's redis entry point calls it):
# own /data, then run as the redis user.
ARG BASE_IMAGE=meridian/python-base:3.11-bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
RUN printf '#!/bin/sh\nchown redis:redis /data /data/users.acl /data/redis-key.pem 2>/dev/null\nexec setpriv --reuid=redis --regid=redis --init-groups "$@"\n' > /usr/local/bin/docker-entrypoint.sh \
 && chmod 755 /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME ["/data"]
CMD ["redis-server"]
