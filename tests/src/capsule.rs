//! Temporary capsule folders.
