"""Worker subprocesses of the pools and the messages they exchange with the supervisor."""
