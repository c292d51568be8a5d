"""Fast tier: one process, no peer processes, no namespaces, no sockets to other processes."""
