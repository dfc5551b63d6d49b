"""PrefixCacheWarmup: a warm-up from start to finish, its prompts and its status."""
