from bigtrain.cli import entry

entry()
