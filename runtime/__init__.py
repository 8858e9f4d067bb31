"""Sans-IO protocol cores and the adapters that run them: sockets, engines, proxy, CLI."""
