"""A request's life in the guard: authentication, validation, token counting, the pipeline of stages from
arrival to answer, and the handlers of the client routes. The bytes on the wire are guard/wire/'s."""
