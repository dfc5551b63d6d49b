"""Caps that a request body's schema enforces (a 400 naming the field) and the engine checks again on the
parameters it is given: one number each, so the two never disagree."""

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_STOP_TOKEN_IDS = 256
MAX_SEQUENCES = 16  # n and best_of
