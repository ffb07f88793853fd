# murmur/prometheus: Prometheus from Debian's `prometheus` package, FROM scratch (no
# container registry). Built by `scripts/images --observe` from its staging folder
# target/images/prometheus:
#   rootfs/  /usr/bin/prometheus and the shared libraries `ldd` lists for it, the package's
#            web assets (/usr/share/prometheus), deploy/prometheus.yml as
#            /etc/prometheus/prometheus.yml, and `mur` for the health check
#            (`mur health http://127.0.0.1:9090/-/ready`)
#   data/    an empty folder: the time series database, owned by the server's user
FROM scratch
COPY rootfs/ /
COPY --chown=10001:10001 data/ /prometheus/
USER 10001:10001
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", "--web.listen-address=0.0.0.0:9090"]
