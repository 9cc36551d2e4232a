"""The PostgreSQL side: pgoutput decoding, source administration, reading changes."""
