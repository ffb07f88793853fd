//! Manifest rules, one test per rule.
use super::*;
