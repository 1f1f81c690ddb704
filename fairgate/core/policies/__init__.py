"""The scheduling policies and the factory that builds one by name."""
