"""What every kvpilot HTTP server shares: connection limits, the text pool, the admin token check and the
build info metric."""
