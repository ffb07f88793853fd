# murmur/mur: the `mur` command (coordinator, worker and client), FROM scratch (no
# registry needed). Built by scripts/images from its staging folder target/images/mur:
#   rootfs/  mur in /usr/local/bin, its shared libraries and the loader (as `ldd` lists
#            them), busybox as /bin/sh and the usual commands, CA certificates,
#            /etc/passwd and /etc/group, and deploy/config.yaml as /etc/murmur/config.yaml
#   data/    an empty folder: the worker's workdir (bundle cache and session folders)
FROM scratch
COPY rootfs/ /
COPY --chown=10001:10001 data/ /data/
# COPY does not keep a folder's mode: make /tmp world-writable with the image's own shell.
RUN ["/bin/sh", "-c", "mkdir -p /tmp && chmod 1777 /tmp"]
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin \
    HOME=/data \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    NO_COLOR=1
USER 10001:10001
WORKDIR /data
ENTRYPOINT ["/usr/local/bin/mur"]
CMD ["--help"]
