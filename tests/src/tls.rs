//! A throwaway PKI for TLS tests (issue #31): a CA, a server certificate for `127.0.0.1`
//! and `localhost`, and a client certificate, all generated in the test with rcgen (ring)
//! and written as PEM files to a folder of the test's own; plus the nats-server `tls { … }`
//! block that uses them.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// PEM files of a CA and the certificates it signed.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// Generates the CA, the server certificate (`127.0.0.1`, `localhost`) and a client
    /// certificate, and a second CA that signed nothing here (to be distrusted).
    ///
    /// # Panics
    /// When generating or writing fails.
    pub fn generate() -> Pki {
        let dir = tempfile::Builder::new().prefix("mur-pki-").tempdir().expect("temp dir");
        let write = |name: &str, text: String| std::fs::write(dir.path().join(name), text).expect("write pem");
        let (ca_pem, issuer) = ca("murmur test CA");
        write("ca.pem", ca_pem);
        let (other_pem, _) = ca("another CA");
        write("other-ca.pem", other_pem);
        let (cert, key) = leaf(&issuer, &["127.0.0.1", "localhost"], ExtendedKeyUsagePurpose::ServerAuth);
        write("server-cert.pem", cert);
        write("server-key.pem", key);
        let (cert, key) = leaf(&issuer, &["murmur-test-client"], ExtendedKeyUsagePurpose::ClientAuth);
        write("client-cert.pem", cert);
        write("client-key.pem", key);
        Pki { dir }
    }

    /// The folder of the PEM files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `ca.pem`: the CA that signed the server and client certificates.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// `other-ca.pem`: a CA that signed neither.
    pub fn other_ca(&self) -> PathBuf {
        self.dir.path().join("other-ca.pem")
    }

    /// `client-cert.pem` and `client-key.pem`.
    pub fn client(&self) -> (PathBuf, PathBuf) {
        (self.dir.path().join("client-cert.pem"), self.dir.path().join("client-key.pem"))
    }

    /// A nats-server `tls { … }` block serving the server certificate; with `verify`,
    /// clients must present a certificate signed by the CA.
    pub fn server_block(&self, verify: bool) -> String {
        let p = |name: &str| self.dir.path().join(name).display().to_string();
        format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {verify}\n  timeout: 5\n}}\n",
            p("server-cert.pem"),
            p("server-key.pem"),
            p("ca.pem")
        )
    }
}

fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key).expect("self-signed CA");
    (cert.pem(), Issuer::new(params, key))
}

fn leaf(issuer: &Issuer<'static, KeyPair>, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("cert params");
    params.distinguished_name.push(DnType::CommonName, names[0]);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, issuer).expect("sign");
    (cert.pem(), key.serialize_pem())
}
