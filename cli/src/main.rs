//! `mur`: the command-line front end (thin: parse, then call the libraries).
fn main() {}
