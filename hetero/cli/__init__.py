"""The `hetero` command line: its commands, their flags, the doctor, tune and convert's quantizer."""
