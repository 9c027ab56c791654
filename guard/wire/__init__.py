"""The wire: the client-port HTTP/1.1 server (httptools), the upstream client, connection deadlines and the
relay between them. It imports no policy (admission/, detect/, pool/scheduling/, records/): what a request
means is the handlers injected by guard/server/app.py."""
