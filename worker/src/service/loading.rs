//! Fetching and loading a task's capsule bundle, kept in memory by name and digest.

use super::*;

/// Fetches (or finds in the cache) and loads the record's capsule bundle. A bundle is
/// named by its digest and never changes, so a loaded capsule is kept in memory by name
/// and digest and reused (issue #9); a failed load is not kept.
pub(super) async fn load_capsule(sh: &Shared, record: &TaskRecord) -> Result<Arc<Capsule>, Loading> {
    let key = (record.capsule.clone(), record.capsule_digest.clone());
    if let Some(capsule) = sh.loaded.lock().expect("loaded capsules lock").get(&key) {
        return Ok(capsule.clone());
    }
    let cache = sh.config.workdir.join("cache");
    let dir = bundle::fetch(&sh.capsules, &record.capsule, &record.capsule_digest, &cache).await.map_err(|e| {
        let reason = format!("error: fetching capsule {}: {e}", record.capsule);
        if e.is_transient() { Loading::Transient(reason) } else { Loading::Failed(reason) }
    })?;
    let env = |k: &str| std::env::var(k).ok();
    let capsule = Arc::new(
        Capsule::load(&dir, &env)
            .map_err(|e| Loading::Failed(format!("error: loading capsule {}: {e}", record.capsule)))?,
    );
    // The tokenizer its sessions will count with, loaded here (once per loaded capsule) on
    // a blocking thread: a session would load it at its first count, on a runtime thread,
    // stalling every task sharing that thread for tens of milliseconds (issue #9). Chosen
    // as a session chooses it (`launch::build_session_parts`): by its driver's kind; a
    // driver that cannot be built fails the session, which then counts nothing.
    let _ = tokio::task::spawn_blocking({
        let (capsule, dir) = (capsule.clone(), dir.clone());
        move || {
            if let Ok(driver) = capsule.driver(&dir) {
                crate::tokens::preload(driver.kind(), capsule.manifest.inference.model.as_deref());
            }
        }
    })
    .await;
    let mut loaded = sh.loaded.lock().expect("loaded capsules lock");
    if loaded.len() >= LOADED_CAPSULES {
        loaded.clear();
    }
    loaded.insert(key, capsule.clone());
    Ok(capsule)
}

/// Why a task's capsule could not be loaded.
pub(super) enum Loading {
    /// The broker did not answer: the dispatch goes back and is fetched again.
    Transient(String),
    /// The bundle is missing, corrupt or its manifest is invalid: the task fails with this.
    Failed(String),
}
