"""The KV contracts daemon and router share: prefix-cache block keys, the KV event wire format, and the ZeroMQ
sockets that carry it."""
