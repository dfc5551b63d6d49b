"""PrefixCacheReset: a reset from start to finish, its status, its pods as they come and go, and the expiry of
finished runs."""
