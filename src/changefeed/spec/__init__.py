"""What a feed is: its definition (spec), its state folder and option values; how secrets in it are kept."""
