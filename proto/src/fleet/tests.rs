//! Fleet rules.
