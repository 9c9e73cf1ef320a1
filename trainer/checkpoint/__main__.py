from strategies.checkpoint.command import main

main()
