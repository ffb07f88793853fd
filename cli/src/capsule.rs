//! `mur capsule push DIR` and `mur capsule ls`: capsule bundles in the cluster's object
//! store, addressed by name and digest (issue #7). A new push changes no task already
//! submitted: a task runs the digest that was latest when it was submitted.

use crate::nats::Connection;
use anyhow::{Context, Result};
use comfy_table::{Table, presets::NOTHING};
use mur_proto::cluster::{CAPSULE_INDEX_BUCKET, CAPSULES_STORE};
use mur_worker::bundle;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `mur capsule …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Upload a capsule folder (manifest, prompts, hooks, scripts) as one bundle.
    Push {
        /// The capsule folder (holding murmur.yaml); several may be given.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the capsules pushed to the cluster (latest digest of each).
    Ls {
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// The object store and index of a running cluster.
///
/// # Errors
/// When the cluster's resources do not exist yet (no coordinator ever ran there).
pub async fn stores(
    client: &async_nats::Client,
) -> Result<(async_nats::jetstream::object_store::ObjectStore, async_nats::jetstream::kv::Store)> {
    let js = async_nats::jetstream::new(client.clone());
    let hint = "no murmur cluster on this server: start `mur dev` or `mur coordinator` first";
    let store = js.get_object_store(CAPSULES_STORE).await.context(hint)?;
    let index = js.get_key_value(CAPSULE_INDEX_BUCKET).await.context(hint)?;
    Ok((store, index))
}

/// Packs and pushes `dir`.
///
/// # Errors
/// A malformed capsule (the field and rule are named), or the cluster is unreachable.
pub async fn push_dir(client: &async_nats::Client, dir: &Path) -> Result<bundle::PushReceipt> {
    let packed = bundle::pack(dir).with_context(|| format!("packing {}", dir.display()))?;
    let (store, index) = stores(client).await?;
    Ok(bundle::push(&store, &index, &packed).await?)
}

/// The most names [`unknown_hint`] lists.
const LISTED: usize = 10;

/// What `mur task send` adds to the coordinator's `no capsule named …` (issue #29): the
/// names closest to `name` by edit distance (Damerau–Levenshtein, at most a third of the
/// name's length, at least 1), then the capsules there are, at most [`LISTED`]:
/// `; did you mean "hello"? capsules on this cluster: hello, queue` or `; no capsule is
/// pushed on this cluster yet`.
pub fn unknown_hint(name: &str, names: &[String]) -> String {
    if names.is_empty() {
        return "; no capsule is pushed on this cluster yet".to_string();
    }
    let most = (name.chars().count() / 3).max(1);
    let distances: Vec<(usize, &String)> =
        names.iter().map(|n| (strsim::damerau_levenshtein(name, n), n)).filter(|(d, _)| *d <= most).collect();
    let closest = distances.iter().map(|(d, _)| *d).min();
    let near: Vec<String> =
        distances.iter().filter(|(d, _)| Some(*d) == closest).map(|(_, n)| format!("{n:?}")).collect();
    let mut hint = String::new();
    if !near.is_empty() {
        hint.push_str(&format!("; did you mean {}?", near.join(" or ")));
    } else {
        hint.push(';');
    }
    let shown: Vec<&str> = names.iter().take(LISTED).map(String::as_str).collect();
    hint.push_str(&format!(" capsules on this cluster: {}", shown.join(", ")));
    if names.len() > LISTED {
        hint.push_str(&format!(" and {} more (mur capsule ls)", names.len() - LISTED));
    }
    hint
}

/// The names of the capsules pushed to the cluster, `None` when they cannot be read.
pub async fn names(client: &async_nats::Client) -> Option<Vec<String>> {
    let (_, index) = stores(client).await.ok()?;
    Some(bundle::list(&index).await.ok()?.into_iter().map(|e| e.name).collect())
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        match cmd {
            Command::Push { dirs, conn, json } => {
                // Every folder is packed (and so checked) before anything is sent: a broken
                // capsule is refused with its own error, even with no server to reach, and
                // none of the folders is pushed.
                let packed = dirs
                    .iter()
                    .map(|dir| bundle::pack(dir).with_context(|| format!("packing {}", dir.display())))
                    .collect::<Result<Vec<_>>>()?;
                let client = conn.connect("mur capsule push").await?;
                let (store, index) = stores(&client).await?;
                for bundle in &packed {
                    let r = bundle::push(&store, &index, bundle).await?;
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"name": r.name, "version": r.version, "digest": r.digest, "bytes": r.bytes})
                        );
                    } else {
                        println!("pushed {} {} {} ({} bytes)", r.name, r.version, &r.digest[..12], r.bytes);
                    }
                }
                Ok(ExitCode::SUCCESS)
            }
            Command::Ls { conn, json } => {
                let client = conn.connect("mur capsule ls").await?;
                let (_, index) = stores(&client).await?;
                let entries = bundle::list(&index).await?;
                if json {
                    println!("{}", serde_json::to_string(&entries)?);
                } else {
                    let mut t = Table::new();
                    t.load_preset(NOTHING).set_header(vec!["NAME", "VERSION", "DIGEST", "BYTES"]);
                    for e in entries {
                        t.add_row(vec![e.name, e.version, e.digest[..12].to_string(), e.bytes.to_string()]);
                    }
                    println!("{t}");
                }
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::unknown_hint;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_wrong_capsule_name_gets_the_closest_names_and_the_list() {
        let there = names(&["hello", "queue", "two-tools"]);
        assert_eq!(
            unknown_hint("helo", &there),
            "; did you mean \"hello\"? capsules on this cluster: hello, queue, two-tools"
        );
        assert_eq!(
            unknown_hint("two_tools", &there),
            "; did you mean \"two-tools\"? capsules on this cluster: hello, queue, two-tools"
        );
        assert_eq!(unknown_hint("builder", &there), "; capsules on this cluster: hello, queue, two-tools");
        assert_eq!(
            unknown_hint("ab", &names(&["aa", "bb", "abc"])),
            "; did you mean \"aa\" or \"bb\" or \"abc\"? capsules on this cluster: aa, bb, abc"
        );
        assert_eq!(unknown_hint("x", &[]), "; no capsule is pushed on this cluster yet");
        let many: Vec<String> = (0..12).map(|i| format!("c{i:02}")).collect();
        assert_eq!(
            unknown_hint("zzzzzz", &many),
            "; capsules on this cluster: c00, c01, c02, c03, c04, c05, c06, c07, c08, c09 and 2 more (mur capsule ls)"
        );
    }
}
