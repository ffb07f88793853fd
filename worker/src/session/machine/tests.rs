//! The loop rules, driven without IO.
use super::*;
