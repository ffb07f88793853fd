//! The capsule index and entries kept beside the bundles in `mur_capsules`.

use super::*;

/// The value under a capsule's name in [`CAPSULE_INDEX_BUCKET`]: its latest bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapsuleIndexEntry {
    /// SHA-256 of the bundle, lowercase hex.
    pub digest: String,
    /// The manifest's `version`.
    pub version: String,
    /// When it was pushed, unix milliseconds.
    pub pushed_at: u64,
    /// The bundle's size in bytes.
    pub bytes: u64,
    /// Whether the manifest says `lifecycle.task_acceptance: queue`: the coordinator runs
    /// at most one task of the capsule at a time cluster-wide. Absent (false) in entries
    /// pushed before the field existed.
    #[serde(default)]
    pub queue: bool,
    /// The manifest's `inference.model`, for pricing (issue #11 §Cost). Absent in entries
    /// pushed before the field existed, and for capsules without a model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The manifest's `description`: the coordinator's A2A card for the capsule says it
    /// (issue #29 item 6). Absent in entries pushed before the field existed, and for
    /// capsules without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// One capsule as `mur capsule ls` shows it: its name and latest bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapsuleEntry {
    /// The capsule's name.
    pub name: String,
    /// SHA-256 of its latest bundle, lowercase hex.
    pub digest: String,
    /// The manifest's `version`.
    pub version: String,
    /// When it was pushed, unix milliseconds.
    pub pushed_at: u64,
    /// The bundle's size in bytes.
    pub bytes: u64,
}
