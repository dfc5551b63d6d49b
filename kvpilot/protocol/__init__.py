"""The OpenAI wire protocol that the daemon serves and the router proxies, in one place both import: the
request bodies (`schema`), the fields they do not model (`fields`), request parsing (`requests`), the error
shape and middleware (`errors`) and JSON replies (`replies`). Nothing here imports a part of kvpilot, so a
change to the daemon's insides cannot change what the router accepts."""
