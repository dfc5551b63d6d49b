"""Caps that a request body's schema enforces (a 400 naming the field) and the engine checks again on the
parameters it is given: one number each, so the two never disagree."""

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_STOP_TOKEN_IDS = 256
MAX_SEQUENCES = 16  # n and best_of
# A cache_salt or weight version (and a scoped reset's adapter name): one bound for requests and scoped
# resets, so every salt a request may key blocks by can be reset by name, and the engine's memo of salts
# holds at most this per entry.
MAX_SCOPE_CHARS = 4096
