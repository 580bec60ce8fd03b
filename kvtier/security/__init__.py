"""Security: principals and the access policy (the one gate), capability tokens, keys, audit."""
