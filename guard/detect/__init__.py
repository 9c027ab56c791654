"""Fill-and-Squeeze detection and its escalation policy."""
