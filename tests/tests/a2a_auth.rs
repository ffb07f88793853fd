//! A2A endpoints authenticate (issue #31): tokens made with `mur auth token create`, stored
//! hashed in the cluster, listed without secrets, revoked; the coordinator's `--http` and
//! `mur run`'s endpoint checking `Authorization: Bearer`.

use mur_tests::procs::Procs;

/// A token is printed once; the cluster keeps its SHA-256 only; `ls` shows names and grants,
/// never a token or a hash; a name is used once; `revoke` removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_printed_once_stored_hashed_listed_without_secrets_and_revoked() {
    let cluster = Procs::start("").await;
    let made = cluster.mur_ok(&["auth", "token", "create", "ci", "--capsule", "echo", "--json"]).await;
    let token = made.last_json()["token"].as_str().expect("token").to_string();
    assert!(token.starts_with("mur_") && token.len() == 68, "{made:?}");

    let js = async_nats::jetstream::new(cluster.client.clone());
    let stored = js.get_key_value("mur_tokens").await.unwrap().get("ci").await.unwrap().expect("record");
    let stored = String::from_utf8(stored.to_vec()).unwrap();
    let sha = mur_nats::tokens::digest(&token).iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert!(stored.contains(&sha), "{stored}");
    assert!(!stored.contains(&token), "the token itself is stored: {stored}");

    let ls = cluster.mur_ok(&["auth", "token", "ls", "--json"]).await;
    let rows = ls.last_json();
    assert_eq!(rows[0]["name"], "ci", "{ls:?}");
    assert_eq!(rows[0]["capsules"], serde_json::json!(["echo"]));
    assert_eq!(rows[0]["scope"], "admin");
    let human = cluster.mur_ok(&["auth", "token", "ls"]).await;
    for run in [&ls, &human] {
        let all = format!("{}{}", run.stdout, run.stderr);
        assert!(!all.contains(&token) && !all.contains(&sha), "a secret in ls: {run:?}");
    }

    let again = cluster.mur(&["auth", "token", "create", "ci"]).await;
    assert_eq!(again.code, 2, "{again:?}");
    assert!(again.stderr.contains("a token named \"ci\" exists"), "{again:?}");
    let bad = cluster.mur(&["auth", "token", "create", "Not.A.Name"]).await;
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("must be 1-64 characters"), "{bad:?}");

    cluster.mur_ok(&["auth", "token", "revoke", "ci"]).await;
    let ls = cluster.mur_ok(&["auth", "token", "ls", "--json"]).await;
    assert_eq!(ls.last_json(), serde_json::json!([]), "{ls:?}");
    let gone = cluster.mur(&["auth", "token", "revoke", "ci"]).await;
    assert_eq!(gone.code, 2, "{gone:?}");
    assert!(gone.stderr.contains("no token named \"ci\""), "{gone:?}");
}
