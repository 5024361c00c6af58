module github.com/gradacc/gradacc/bindings/go

go 1.21
