//! `mur auth init DIR [--tls] [--host NAME]…`: a secured cluster in one command (issue #31).
//! Writes a nats-server configuration whose users are nkeys, one per role, each with the
//! subject permissions of its role (enforced by nats-server), and one credentials file per
//! role holding that user's seed (`--creds` reads it); with `--tls`, a CA and a server
//! certificate for the `--host` names and 127.0.0.1, and the `tls` block that serves it.
//!
//! Why nkey users in the server's own configuration rather than JWTs under an operator: the
//! server enforces the permissions it reads from its file, no resolver or account server is
//! needed, the seed never leaves the machine its file is on (the server holds public keys
//! only), and revoking a role is deleting its line and reloading the server. The
//! permissions and what each role can still do are in `docs/security.md`.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `mur auth …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Write DIR/nats-server.conf and one credentials file per role (coordinator, worker,
    /// client, approver, admin), and the coordinator's identity file (identity.creds, for
    /// `mur coordinator --identity`); with --tls, a CA and a server certificate too.
    Init(InitArgs),
    /// A2A bearer tokens for the coordinator's `--http` endpoint: create, ls, revoke.
    #[command(subcommand)]
    Token(Box<TokenCommand>),
}

/// `mur auth token …`
#[derive(clap::Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a token and print it once (only its SHA-256 is stored in the cluster).
    Create {
        /// The token's name (a-z, 0-9, '-', '_'): what `ls` and the logs show.
        name: String,
        /// A capsule the token may reach (repeatable); none = every capsule.
        #[arg(long = "capsule", value_name = "CAPSULE")]
        capsules: Vec<String>,
        /// `admin` (send, cancel, get, list) or `read` (get and list only).
        #[arg(long, value_enum, default_value = "admin")]
        scope: ScopeArg,
        /// Print {"name", "token", "capsules", "scope"} as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: crate::nats::Connection,
    },
    /// List the tokens: names, capsules, scope, age (never a token or its hash).
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: crate::nats::Connection,
    },
    /// Revoke a token: endpoints refuse it from the moment they see the change.
    Revoke {
        /// The token's name.
        name: String,
        #[command(flatten)]
        conn: crate::nats::Connection,
    },
}

/// A token's scope on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum ScopeArg {
    /// Send, cancel, get, list.
    Admin,
    /// Get and list only.
    Read,
}

impl From<ScopeArg> for mur_proto::cluster::Scope {
    fn from(s: ScopeArg) -> Self {
        match s {
            ScopeArg::Admin => mur_proto::cluster::Scope::Admin,
            ScopeArg::Read => mur_proto::cluster::Scope::Read,
        }
    }
}

/// `mur auth init DIR [--tls] [--host NAME]… [--force] [--json]`
#[derive(clap::Args, Debug)]
pub struct InitArgs {
    /// The folder to write (made if missing).
    dir: PathBuf,
    /// Also write ca.pem, server-cert.pem and server-key.pem and a tls block serving them.
    #[arg(long)]
    tls: bool,
    /// A name or address the server certificate is valid for, besides 127.0.0.1 and
    /// localhost (repeatable; with --tls).
    #[arg(long = "host", value_name = "NAME", requires = "tls")]
    hosts: Vec<String>,
    /// Overwrite the files of an earlier `mur auth init` (new keys: every role's old file
    /// stops working).
    #[arg(long)]
    force: bool,
    /// Print the files written as JSON.
    #[arg(long)]
    json: bool,
}

/// A role: its name (the file `NAME.creds`) and the permissions nats-server enforces.
pub struct Role {
    /// `coordinator`, `worker`, `client`, `approver`, `admin`.
    pub name: &'static str,
    /// The NATS permissions block (`permissions: { … }`).
    pub permissions: String,
}

/// Subjects no role but the coordinator and admin may publish to: the JetStream calls that
/// make, change or destroy streams (every KV bucket and the object store are streams).
const STREAM_ADMIN: [&str; 5] = [
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
];

/// The roles `mur auth init` writes, with their permissions. Each is everything (`>`) but a
/// deny list: nats-server applies a deny over an allow. Why a deny list and what it leaves
/// open: `docs/security.md`.
pub fn roles() -> Vec<Role> {
    let everything = |publish_deny: &[&str], subscribe_deny: &[&str]| {
        let list = |subjects: &[&str]| subjects.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
        format!(
            "{{\n          publish: {{ allow: [\">\"], deny: [{}] }}\n          subscribe: {{ allow: [\">\"], deny: [{}] }}\n        }}",
            list(publish_deny),
            list(subscribe_deny)
        )
    };
    let full =
        "{\n          publish: { allow: [\">\"] }\n          subscribe: { allow: [\">\"] }\n        }".to_string();
    // A worker: pulls and acks dispatches, writes task records, sessions, its heartbeat and
    // fan-out permits, publishes traces, reads capsules, submits completion tasks. It may
    // not push capsules, touch the leader lease, fleets or jobs, call the fleet API, publish
    // dispatches or cancel tasks.
    // A worker purges a finished task's checkpoints (a subject-filtered purge of
    // KV_mur_sessions), so its purge deny names every other stream.
    let mut worker: Vec<&str> = STREAM_ADMIN.iter().copied().filter(|s| !s.contains("PURGE")).collect();
    worker.extend([
        "$JS.API.STREAM.PURGE.KV_mur_tasks",
        "$JS.API.STREAM.PURGE.KV_mur_workers",
        "$JS.API.STREAM.PURGE.KV_mur_capsule_index",
        "$JS.API.STREAM.PURGE.KV_mur_leader",
        "$JS.API.STREAM.PURGE.KV_mur_fleets",
        "$JS.API.STREAM.PURGE.KV_mur_jobs",
        "$JS.API.STREAM.PURGE.KV_mur_fanout",
        "$JS.API.STREAM.PURGE.KV_mur_tokens",
        "$JS.API.STREAM.PURGE.OBJ_mur_capsules",
        "$JS.API.STREAM.PURGE.MUR_DISPATCH",
        "$JS.API.STREAM.PURGE.MUR_TRACE",
        "$JS.API.STREAM.PURGE.MUR_FLEET",
        "$KV.mur_leader.>",
        "$KV.mur_fleets.>",
        "$KV.mur_jobs.>",
        "$KV.mur_capsule_index.>",
        "$KV.mur_tokens.>",
        "$O.mur_capsules.>",
        "mur.api.fleet.>",
        "mur.leader.>",
        "mur.fleet.>",
        // Dispatches come from the coordinator only, and so do cancels: a worker's key
        // cannot inject a task into the workers' queue nor stop another worker's task.
        "mur.dispatch",
        "mur.dispatch.>",
        "mur.cancel.>",
        "mur.api.task.cancel",
    ]);
    // A client (`mur task …`, `mur fleet …`, `mur cluster status`, `mur trace`): the API
    // and reading; no KV or object write, no dispatch, trace or fleet-channel publish, no
    // pulling dispatches, no approving.
    let mut client: Vec<&str> = STREAM_ADMIN.to_vec();
    client.extend([
        "$KV.>",
        "$O.>",
        "mur.dispatch",
        "mur.dispatch.>",
        "mur.trace.>",
        "mur.cancel.>",
        "mur.leader.>",
        "mur.fleet.>",
        "$JS.API.CONSUMER.MSG.NEXT.MUR_DISPATCH.>",
        "$JS.API.CONSUMER.CREATE.MUR_DISPATCH.>",
        "$JS.API.CONSUMER.DURABLE.CREATE.MUR_DISPATCH.>",
        "$JS.API.CONSUMER.DELETE.MUR_DISPATCH.>",
        "$JS.ACK.MUR_DISPATCH.>",
    ]);
    let approver = client.clone();
    client.extend(["mur.api.fleet.approve", "mur.api.fleet.deny"]);
    let client_subscribe = ["mur.dispatch", "mur.dispatch.>"];
    vec![
        Role { name: "coordinator", permissions: full.clone() },
        Role { name: "worker", permissions: everything(&worker, &[]) },
        Role { name: "client", permissions: everything(&client, &client_subscribe) },
        Role { name: "approver", permissions: everything(&approver, &client_subscribe) },
        Role { name: "admin", permissions: full },
    ]
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    let args = match cmd {
        Command::Init(args) => args,
        Command::Token(cmd) => return token(*cmd),
    };
    let written = init(&args.dir, args.tls, &args.hosts, args.force)?;
    if args.json {
        let files: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
        println!("{}", serde_json::json!({ "dir": args.dir.display().to_string(), "files": files }));
    } else {
        for path in &written {
            println!("{}", path.display());
        }
        eprintln!(
            "start the server with `nats-server -c {}`; give each process its role's file with --creds, and the \
             coordinator --identity {} too{}",
            args.dir.join("nats-server.conf").display(),
            args.dir.join("identity.creds").display(),
            if args.tls { format!(" and --tls-ca {}", args.dir.join("ca.pem").display()) } else { String::new() }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the files into `dir`; returns their paths.
///
/// # Errors
/// A file exists already (without `force`), or a file cannot be written.
pub fn init(dir: &Path, tls: bool, hosts: &[String], force: bool) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("mur auth init: {}", dir.display()))?;
    let mut names: Vec<String> = vec!["nats-server.conf".into()];
    names.extend(roles().iter().map(|r| format!("{}.creds", r.name)));
    names.push("identity.creds".into());
    if tls {
        names.extend(["ca.pem", "server-cert.pem", "server-key.pem"].map(String::from));
    }
    if !force && let Some(existing) = names.iter().map(|n| dir.join(n)).find(|p| p.exists()) {
        anyhow::bail!(
            "mur auth init: {} exists: pass --force to write new keys (every role's old file then stops working)",
            existing.display()
        );
    }
    let mut written = Vec::new();
    let mut users = String::new();
    let mut identities = mur_nats::identity::Identities::default();
    for role in roles() {
        let key = nkeys::KeyPair::new_user();
        identities.insert(key.public_key(), role.name);
        let seed = key.seed().context("an nkey seed")?;
        let creds = format!(
            "# murmur role {name}: nkey user {public}, written by `mur auth init`.\n# Keep it secret: whoever \
             holds it acts as the {name}. Use it with `--creds` (NATS_CREDS), or `nats --nkey`.\n\n-----BEGIN \
             USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n",
            name = role.name,
            public = key.public_key()
        );
        let path = dir.join(format!("{}.creds", role.name));
        write_secret(&path, &creds)?;
        written.push(path);
        users.push_str(&format!(
            "      # {}\n      {{\n        nkey: {}\n        permissions: {}\n      }}\n",
            role.name,
            key.public_key(),
            role.permissions
        ));
    }
    // The identity connection's user, alone in its account: the coordinator serves the API
    // calls that record who called there, and the roles' account imports them with `share`,
    // so nats-server states the caller of each (mur_nats::identity).
    let identity_key = nkeys::KeyPair::new_user();
    let identity_path = dir.join("identity.creds");
    write_secret(
        &identity_path,
        &format!(
            "# murmur identity connection: nkey user {public} of the account MUR_ID, written by `mur auth \
             init`.\n# For `mur coordinator --identity` only: the coordinator serves approvals, fleet stop/start \
             and\n# jobs sent on it, and records the name below of the public key nats-server states.\n# Keep it \
             secret: whoever holds it answers those calls.\n\n-----BEGIN USER NKEY SEED-----\n{seed}\n------END \
             USER NKEY SEED------\n\n# Who is who (add a line when you add a user to nats-server.conf).\n{block}",
            public = identity_key.public_key(),
            seed = identity_key.seed().context("an nkey seed")?,
            block = identities.block()
        ),
    )?;
    written.push(identity_path);
    let subjects = mur_nats::identity::IDENTITY_SUBJECTS;
    let imports = subjects
        .iter()
        .map(|s| format!("      {{ service: {{ account: MUR_ID, subject: {s:?} }}, share: true }}\n"))
        .collect::<String>();
    let exports = subjects.iter().map(|s| format!("      {{ service: {s:?} }}\n")).collect::<String>();
    let mut tls_block = String::new();
    if tls {
        let (ca, cert, key) = certificates(hosts)?;
        for (name, text, secret) in
            [("ca.pem", ca, false), ("server-cert.pem", cert, false), ("server-key.pem", key, true)]
        {
            let path = dir.join(name);
            if secret {
                write_secret(&path, &text)?;
            } else {
                std::fs::write(&path, text).with_context(|| format!("mur auth init: {}", path.display()))?;
            }
            written.push(path);
        }
        let abs = |n: &str| std::path::absolute(dir.join(n)).unwrap_or_else(|_| dir.join(n)).display().to_string();
        tls_block = format!(
            "# TLS: clients verify the server with ca.pem (--tls-ca).\ntls {{\n  cert_file: {:?}\n  key_file: {:?}\n  \
             ca_file: {:?}\n  timeout: 5\n}}\n\n",
            abs("server-cert.pem"),
            abs("server-key.pem"),
            abs("ca.pem")
        );
    }
    let conf = format!(
        "# nats-server configuration written by `mur auth init`: one nkey user per murmur role, each with\n# the \
         subject permissions of its role (docs/security.md). Revoke a role: delete its user and\n# reload the \
         server (`nats-server --signal reload`).\n\njetstream {{}}\n\n{tls_block}accounts {{\n  MUR {{\n    \
         jetstream: enabled\n    users: [\n{users}    ]\n    # The API calls that record who called reach the \
         coordinator\n    # through MUR_ID, so that the server states the caller.\n    imports: [\n{imports}    ]\n  \
         }}\n  MUR_ID {{\n    users: [ {{ nkey: {identity} }} ]\n    exports: [\n{exports}    ]\n  }}\n}}\n",
        identity = identity_key.public_key()
    );
    let path = dir.join("nats-server.conf");
    std::fs::write(&path, conf).with_context(|| format!("mur auth init: {}", path.display()))?;
    written.insert(0, path);
    Ok(written)
}

/// Writes `text` to `path` readable by its owner only (0600), replacing the file.
fn write_secret(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("mur auth init: {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("mur auth init: {}", path.display()))
}

/// A CA, and a server certificate it signed for `hosts`, 127.0.0.1 and localhost, usable
/// for serving clients and for the routes between cluster nodes (server and client auth):
/// the CA's PEM, the certificate's, and its key's.
fn certificates(hosts: &[String]) -> Result<(String, String, String)> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().context("the CA key")?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).context("the CA")?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name.push(DnType::CommonName, "murmur cluster CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_pem = ca.self_signed(&ca_key).context("the CA")?.pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut names: Vec<String> = vec!["127.0.0.1".into(), "localhost".into()];
    names.extend(hosts.iter().filter(|h| !h.is_empty()).cloned());
    names.dedup();
    let key = KeyPair::generate().context("the server key")?;
    let mut params = CertificateParams::new(names.clone())
        .with_context(|| format!("--host: a name or address the certificate can carry, got {names:?}"))?;
    params.distinguished_name.push(DnType::CommonName, "murmur nats-server");
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    // ClientAuth too: in a cluster each node presents this certificate when it opens a route
    // to another, and nats-server requires and verifies a client certificate on every route
    // (deploy/nats.conf), which Go accepts only with the clientAuth usage.
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &issuer).context("the server certificate")?;
    Ok((ca_pem, cert.pem(), key.serialize_pem()))
}

/// Runs a `mur auth token` command.
fn token(cmd: TokenCommand) -> Result<ExitCode> {
    use mur_nats::clock::Clock;
    use mur_nats::tokens;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        match cmd {
            TokenCommand::Create { name, capsules, scope, json, conn } => {
                if !mur_proto::cluster::is_valid_token_name(&name) {
                    return Err(
                        crate::Invalid(format!("NAME {name:?}: {}", mur_proto::cluster::TOKEN_NAME_RULE)).into()
                    );
                }
                if let Some(bad) = capsules.iter().find(|c| !mur_proto::manifest::is_valid_name(c)) {
                    return Err(crate::Invalid(format!("--capsule {bad:?}: not a capsule name")).into());
                }
                let client = conn.connect("mur auth token create").await?;
                let store = tokens::store(&async_nats::jetstream::new(client)).await?;
                let scope: mur_proto::cluster::Scope = scope.into();
                let now = mur_nats::clock::SystemClock.now_ms();
                let token = tokens::create(&store, &name, &capsules, scope, now).await?;
                if json {
                    println!(
                        "{}",
                        serde_json::json!({ "name": name, "token": token, "capsules": capsules, "scope": scope })
                    );
                } else {
                    println!("{token}");
                    eprintln!(
                        "token {name:?} ({}, {}): shown once, keep it secret; senders pass it with --token-file FILE \
                         or MUR_A2A_TOKEN",
                        scope.as_str(),
                        if capsules.is_empty() { "every capsule".to_string() } else { capsules.join(", ") }
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            TokenCommand::Ls { json, conn } => {
                let client = conn.connect("mur auth token ls").await?;
                let store = tokens::store(&async_nats::jetstream::new(client)).await?;
                let records = tokens::list(&store).await?;
                if json {
                    let rows: Vec<serde_json::Value> = records
                        .iter()
                        .map(|r| {
                            serde_json::json!({
                                "name": r.name, "capsules": r.capsules, "scope": r.scope, "created_at": r.created_at
                            })
                        })
                        .collect();
                    println!("{}", serde_json::Value::Array(rows));
                } else {
                    let now = mur_nats::clock::SystemClock.now_ms();
                    let mut table = comfy_table::Table::new();
                    table
                        .load_preset(comfy_table::presets::NOTHING)
                        .set_header(vec!["NAME", "SCOPE", "CAPSULES", "AGE"]);
                    for r in &records {
                        let age = std::time::Duration::from_secs(now.saturating_sub(r.created_at) / 1000);
                        table.add_row(vec![
                            r.name.clone(),
                            r.scope.as_str().to_string(),
                            if r.capsules.is_empty() { "*".to_string() } else { r.capsules.join(",") },
                            humantime::format_duration(age).to_string(),
                        ]);
                    }
                    println!("{table}");
                }
                Ok(ExitCode::SUCCESS)
            }
            TokenCommand::Revoke { name, conn } => {
                let client = conn.connect("mur auth token revoke").await?;
                let store = tokens::store(&async_nats::jetstream::new(client)).await?;
                tokens::revoke(&store, &name).await?;
                eprintln!("token {name:?} revoked");
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, pem::PemObject};

    /// The DER of an OID's content octets, as they appear inside a certificate.
    fn oid(der: &[u8], content: &[u8]) -> bool {
        der.windows(content.len()).any(|w| w == content)
    }

    #[test]
    fn the_server_certificate_serves_clients_and_opens_cluster_routes() {
        let (_, cert, _) = certificates(&["nats-1".to_string()]).unwrap();
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        // id-kp-serverAuth 1.3.6.1.5.5.7.3.1 and id-kp-clientAuth 1.3.6.1.5.5.7.3.2 (RFC 5280
        // §4.2.1.12): nats-server verifies a route's certificate as a client certificate.
        assert!(oid(&der, &[0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01]), "serverAuth");
        assert!(oid(&der, &[0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x02]), "clientAuth");
        assert!(oid(&der, b"nats-1"), "the --host name is in the certificate");
    }
}
