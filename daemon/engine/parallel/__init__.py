"""The engine's ranks: data parallel (N engine-core processes behind one server, and which rank gets a
request) and tensor parallel (one model sharded over N processes)."""
