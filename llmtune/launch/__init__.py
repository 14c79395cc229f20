"""The launch room: a Plan becomes processes, supervised until they end."""
