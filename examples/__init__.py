"""Example agent and environment servers, a demo, and a trainer loop."""
