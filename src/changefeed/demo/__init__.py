"""`changefeed demo`: a replica demo and a Delta Lake demo on servers started locally."""
