"""The live operator console: a page on the admin listener fed by a stream of the guard's state."""
