"""The guard's HTTP side: the app, the request pipeline and its stages (auth, validation, token counting),
the relay to engines, and errors in the OpenAI shape."""
