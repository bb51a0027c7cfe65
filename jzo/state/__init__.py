"""The engine's state: its device part (jitted global arrays), its host part
(jzo.host), their bundle, and how it is built leaf by leaf."""
