//! `mcp-test-server`: the testkit's MCP server ([`mur_tests::mcp::TestServer`]) on stdio.
//! `--fail-start` writes two lines to stderr and exits with code 2 before speaking MCP.

use rmcp::ServiceExt;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    mur_nats::tls::install_crypto_provider();
    if std::env::args().any(|a| a == "--fail-start") {
        eprintln!("loading the index");
        eprintln!("fatal: cannot open the database");
        std::process::exit(2);
    }
    eprintln!("mcp-test-server ready");
    let service = mur_tests::mcp::TestServer::default().serve(rmcp::transport::stdio()).await.expect("initialize");
    let _ = service.waiting().await;
}
