"""The protocol floor: wire format, peer ids, CURVE security and the guarded-loop helper every stage imports."""
