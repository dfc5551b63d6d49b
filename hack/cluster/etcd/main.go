// Command etcd is the etcd server, built from the pinned go.etcd.io/etcd/server/v3
// module; it is what upstream's own etcd main does.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
