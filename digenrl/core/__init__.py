"""The sans-I/O brain: scheduler, credit ledger, step plan, BTS and their types (no asyncio, zmq or torch)."""
