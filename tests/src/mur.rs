//! Running the built `mur` binary.
