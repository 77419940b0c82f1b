"""kvtc (Staniszewski & Łańcucki, ICLR 2026): the storage method; ``codec.py`` registers it."""
